"""Router studies: a grid of training runs over one base config, and its report (``moe-dist sweep``)."""
from .spec import RunSpec, Study, expand, load_study

__all__ = ["RunSpec", "Study", "expand", "load_study"]
