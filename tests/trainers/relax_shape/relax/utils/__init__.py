"""Relax-shaped test package (tests/trainers/relax_shape/README.md)."""
