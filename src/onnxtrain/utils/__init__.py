"""Small helpers shared by every front end (no torch here)."""
