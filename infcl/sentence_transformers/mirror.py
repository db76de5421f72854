"""The loss classes' constructors: sentence-transformers' own, mirrored.

Each class takes its sentence-transformers parent's constructor arguments (the same names, defaults, kinds
and order, by position or by keyword) and infcl's keyword-only ``group`` and ``backend``. :func:`mirrors`
builds that signature from theirs, so that the two cannot drift apart, and hands the class's constructor
body the arguments by name.
"""

import inspect
from typing import Any, Callable, Dict

# infcl's keyword-only arguments, after sentence-transformers' own.
EXTRAS = (
    inspect.Parameter("group", inspect.Parameter.KEYWORD_ONLY, default=None),
    inspect.Parameter("backend", inspect.Parameter.KEYWORD_ONLY, default="auto"),
)
# The constructor arguments whose every option the objectives compute (sentence-transformers 6.3's, as 6.2's). An
# argument their classes gain later stays out of ours (a TypeError, not an option silently ignored) until it
# is mapped and named here; tests/test_sentence_transformers.py compares the two signatures.
MAPPED = frozenset(
    {
        "model",
        "guide",
        "scale",
        "similarity_fct",
        "temperature",
        "mini_batch_size",
        "mini_batch_num_tokens",
        "score_mini_batch_size",
        "show_progress_bar",
        "gather_across_devices",
        "directions",
        "partition_mode",
        "hardness_mode",
        "hardness_strength",
        "margin_strategy",
        "margin",
        "contrast_anchors",
        "contrast_positives",
        # MatryoshkaLoss (a wrapper: its infcl options are the wrapped loss's)
        "loss",
        "matryoshka_dims",
        "matryoshka_weights",
        "n_dims_per_step",
    }
)

# A constructor body: (self, sentence-transformers' arguments by name, group, backend).
Body = Callable[[Any, Dict[str, Any], Any, str], None]


def mirrors(st_class: type, extras=EXTRAS) -> Callable[[Body], Callable[..., None]]:
    """Decorator of a loss class's ``__init__(self, arguments, group, backend)``: the constructor then takes
    ``st_class.__init__``'s arguments (those in :data:`MAPPED`) and ``extras`` (:data:`EXTRAS`), binds a call
    as Python would (TypeError naming the argument on a wrong one), and runs the body with
    sentence-transformers' arguments by name (defaults filled in, ``self`` left out) and the extras' values
    (``group`` and ``backend``; none for a wrapper, ``extras=()``)."""
    theirs = inspect.signature(st_class.__init__)
    self_param, *params = theirs.parameters.values()
    signature = theirs.replace(parameters=[self_param, *(p for p in params if p.name in MAPPED), *extras])

    def decorate(body: Body) -> Callable[..., None]:
        def __init__(self, *args, **kwargs) -> None:
            try:
                bound = signature.bind(self, *args, **kwargs)
            except TypeError as err:  # name the class, as Python's own message names the function
                raise TypeError(f"{type(self).__name__}(): {err}") from None
            bound.apply_defaults()
            arguments = {name: value for name, value in bound.arguments.items() if name != self_param.name}
            values = [arguments.pop(p.name) for p in extras]
            body(self, arguments, *values)

        __init__.__signature__ = signature
        __init__.__doc__ = body.__doc__
        __init__.__qualname__ = body.__qualname__
        __init__.__module__ = body.__module__
        return __init__

    return decorate
