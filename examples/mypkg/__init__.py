"""A user's own package: networks and data for multiloss's recipes, chosen by config, no recipe edited."""
