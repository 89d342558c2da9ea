"""A stand-in for torch.utils.tensorboard.SummaryWriter in the report
tests: the scalars written, by tag, each tag at most once."""


class ScalarWriter:
    def __init__(self):
        self.scalars = {}

    def add_scalar(self, tag, value, step):
        assert tag not in self.scalars, f"{tag} written twice"
        self.scalars[tag] = value

    def add_histogram_raw(self, *args, **kwargs):
        pass
