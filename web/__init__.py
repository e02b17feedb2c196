"""spikewatch dashboard (FastAPI + Plotly)."""
