"""FlashLoop's lazy updates in the runtime: their configuration groups, the prefill
window geometry the scheduler plans with, and the device-side token selection.

The readable oracle for all of it is `specloop.model.flashloop_reference`, which shares
no code with this package.
"""
