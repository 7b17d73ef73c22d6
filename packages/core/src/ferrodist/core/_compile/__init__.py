"""Compiling ferrodist's loops without ever compiling in a caller's thread: the shared JIT
decorator and its locked disk cache (``jit``), the background thread and the fronts that
never compile (``background``), the compile helper process (``helper``), and a compiled
loop with its interpreted twin as one object (``twin``)."""
