"""hybrid's communicator inside other people's trainers: :mod:`.lightning` (a Lightning ``Callback``) and
:mod:`.transformers` (a Hugging Face ``TrainerCallback``). accelerate needs nothing of its own:
``hybrid.attach(accelerator.prepare(model))``.

Each module imports its library on import; this package imports neither. Both are thin over
:func:`hybrid.core.attach.connect`, which is the hook hybrid's own trainer registers.
"""
