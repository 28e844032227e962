"""The ``hasten`` command line (imported by nothing else in the library)."""
