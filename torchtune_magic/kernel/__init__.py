"""The live kernel, kept as if the cell ran once: the torch objects a cell reaches
(`discovery`), reversible fixes (`fixes`) and the ones applied now (`applied`), the
state snapshot and its exact restore (`state`, `pystate`, `one_way`), the C allocator
under CPU tensors (`allocator`) and the stack a plain run has (`plain_stack`).
"""
