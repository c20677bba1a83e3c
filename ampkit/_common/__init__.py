"""Small helpers every layer uses: files, logging, errors, CPU flags, text tables."""
