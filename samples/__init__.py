"""What the app offers to try: the pictures in this folder, and a clip drawn at use (`clip.py`)."""
