"""Text data: the corpus and its split (text.py), evaluation windows (windows.py), calibration sets (calibration.py)."""
