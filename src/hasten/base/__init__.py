"""hasten's ground floor: the plugins, constants, environment and import checks, sizes and serialisation
helpers that every layer above uses; it imports nothing of hasten but ``exceptions`` and ``_lazy``.

Accelerate shows these modules at ``accelerate.utils.<module>``: ``hasten.utils.<module>`` is the same
module object (an alias), and ``hasten.utils`` re-exports their names lazily.
"""
