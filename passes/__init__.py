"""Compiler passes: each a plain function from one IR to the next."""
