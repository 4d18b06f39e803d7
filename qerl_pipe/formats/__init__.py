"""Number formats and checkpoint layouts: pure math and file layouts, no I/O policy, no import of
`model/`. Import from the submodules (`nvfp4`, `nf4`, `names`, `checkpoint`, the two layouts).
See docs/formats.md, section "Formats: NVFP4, NF4 and the checkpoint layouts" (the module table)."""
