"""Diagnostics of the kit's kernels, apart from the kernels: SASS instruction counts
(`python -m tools.instruction_count`) and ncu source-level stall sites
(`python -m tools.stall_sites`)."""
