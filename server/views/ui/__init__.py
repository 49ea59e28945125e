"""The dashboard's page, scripts and styles, shipped as package data (server/views/dashboard.py)."""
