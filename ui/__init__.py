"""Streamlit-side helpers shared by the pages. The engine never imports from here."""
