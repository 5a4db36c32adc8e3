"""The daemon's HTTP routes, one module per area; ``daemon/app.py`` puts them in one table behind its guards."""
