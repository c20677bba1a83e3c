"""The opt levels and initialize's options, as data; ``resolve`` turns a level and overrides into Properties."""
