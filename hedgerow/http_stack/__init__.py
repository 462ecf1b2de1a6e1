"""Every adaptation of hypercorn's and aioquic's private internals, one small module each."""
