"""secure_agg package."""
