"""What the UI and the API share in one server process: the engine slot and the settings in force."""
