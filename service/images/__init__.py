"""Encoded images (JPEG, PNG, WebP) made into a model's input: header checks and decoding (decode.py, Pillow, on the
CPU), resize and center crop in torch (preprocess.py, the same code on the CPU or a GPU), and JPEGs decoded in
batches on the GPU where torchvision's nvJPEG decoder works (gpu_decode.py). Front ends and engines both import it:
it imports neither."""
