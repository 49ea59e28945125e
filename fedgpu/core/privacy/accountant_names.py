"""The accountants a job may name: a leaf, so the job parser (settings.py) and the accountant
itself (accountant.py, which loads dp-accounting) both read it without importing each other."""

# dp-accounting's accountants: Renyi DP (fast, slightly loose) and privacy loss distributions
# (tight, slower to compose over many rounds).
ACCOUNTANTS = ("rdp", "pld")
