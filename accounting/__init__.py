"""accounting package."""
