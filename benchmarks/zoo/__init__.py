"""The public model zoo (``python -m benchmarks.zoo``): real architectures from a model library,
trained with float32, torch.amp and autoscale side by side. ``models`` builds them, ``compare``
trains and measures one, ``__main__`` writes docs/results/zoo.md."""
