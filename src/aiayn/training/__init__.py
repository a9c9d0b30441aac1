"""The training engine shared by every task: schedules, loss, the Task protocol, the trainer,
checkpoints and run directories."""

from aiayn.training.config import TrainingConfig
from aiayn.training.loss import label_smoothed_cross_entropy
from aiayn.training.optimizer import make_optimizer
from aiayn.training.run import Run, load_run
from aiayn.training.schedules import Schedule, noam, warmup_cosine
from aiayn.training.task import Task
from aiayn.training.trainer import Trainer, train
from aiayn.training.weights import average_checkpoints

__all__ = ["Run", "Schedule", "Task", "Trainer", "TrainingConfig", "average_checkpoints",
           "label_smoothed_cross_entropy", "load_run", "make_optimizer",
           "noam", "train", "warmup_cosine"]
