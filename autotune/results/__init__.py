"""What a user reads: the best configs (best.py), exports, status, notifications, progress lines and the
HTML report."""
