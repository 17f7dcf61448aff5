"""Images into a model: files checked and made into pixels (images.py, no torch), what the
shared code knows of a model's vision (shape.py), the SigLIP tower (siglip.py) and the encoder
a worker runs with its cache (encoder.py)."""
