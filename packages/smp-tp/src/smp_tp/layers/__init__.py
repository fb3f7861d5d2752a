"""Built-in distributed modules."""
