"""ferrodist.nn: a small numpy model kit with explicit backward, for proving DDP and pipelines without PyTorch.

Parameters announce each gradient the moment it is final (``register_post_accumulate_grad_hook``),
gradients accumulate in place (so they may live in a DDP bucket), and a module's backward can be
split into its input and weight halves, with several micro-batches in flight (``stash``/``restore``).

Example:
    >>> model = Sequential(Linear(4, 8, rng=0), ReLU(), Linear(8, 3, rng=1))
    >>> loss_fn, opt = CrossEntropyLoss(), SGD(model.parameters(), lr=0.1, momentum=0.9)
    >>> loss = loss_fn(model(np.ones((5, 4))), np.array([0, 1, 2, 0, 1]))
    >>> _ = model.backward(loss_fn.backward())   # fills every parameter's .grad
    >>> opt.step(); opt.zero_grad()
"""

from ._layers import Linear, ReLU, Sequential, Tanh
from ._losses import CrossEntropyLoss, MSELoss
from ._module import Module
from ._optim import SGD, Adam, Optimizer
from ._parameter import Parameter, RemovableHandle

__all__ = [
    "Adam",
    "CrossEntropyLoss",
    "Linear",
    "MSELoss",
    "Module",
    "Optimizer",
    "Parameter",
    "ReLU",
    "RemovableHandle",
    "SGD",
    "Sequential",
    "Tanh",
]
