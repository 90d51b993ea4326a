"""Engine workers: the engine (scheduler, model runner, sampler) and the worker actor around it.

Importing this package is cheap; torch is imported only by the modules that run the model.
"""
