"""The live kernel, kept as if the cell ran once: the torch objects a cell reaches
(`discovery`), reversible fixes (`fixes`) and the ones applied now (`applied`), the state
snapshot and its exact restore (`state`; plain Python objects in `pystate`, `pyparts`,
`pywalk`; a Trainer's bookkeeping in `trainers`; what cannot be put back in `one_way`), the
C allocator under CPU tensors (`allocator`) and the stack a plain run has (`plain_stack`).
"""
