"""slime-shaped test package (tests/trainers/slime_shape/README.md)."""
