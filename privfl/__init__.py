"""privfl package."""
