"""What the UI and the API share in one server process: the server's settings, the engine slot, sign-in state."""
