"""The pieces of ``bench/studies/decode_graph_sweep.py``: timing with the copy's roofline, the layer, the phases."""
