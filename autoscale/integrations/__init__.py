"""Drop-in integrations with the training frameworks that own the torch.amp loop.

* ``autoscale.integrations.lightning``: Lightning's ``Trainer`` and ``Fabric`` (precision plugins).
* ``autoscale.integrations.huggingface``: Hugging Face ``transformers.Trainer`` and ``accelerate``.

Each module imports its framework; this package imports none of them, and ``import autoscale``
does not import this package.
"""
