"""Runners for the peers vlscope is measured against (llama.cpp, OpenVINO GenAI), timed as vlscope is."""
