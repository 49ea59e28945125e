"""`fedgpu up|down|ps|logs`: the compose deployment, one module per command; compose.py
drives Compose v2 and reads the containers through the Docker SDK."""
