"""The transformation matrix of `tests/test_matrix.py`: its harness and its situations,
one module per kind (transformations, modes of differentiation, inputs)."""
