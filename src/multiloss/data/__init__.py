"""LightningDataModules over data that ships offline (nothing downloads at run time), and the user's own files."""

from multiloss.data.arrays import ArrayDataModule
from multiloss.data.columns import BadSample
from multiloss.data.digits import DigitPairsDataModule, DigitsDataModule, StackedDigitsDataModule
from multiloss.data.images import ImagesDataModule
from multiloss.data.npz import NpzDataModule
from multiloss.data.regression import TaskRegressionDataModule
from multiloss.data.samples import SamplesDataModule
from multiloss.data.text import TextDataModule, Vocabulary

__all__ = [
    "ArrayDataModule",
    "BadSample",
    "DigitPairsDataModule",
    "DigitsDataModule",
    "ImagesDataModule",
    "NpzDataModule",
    "SamplesDataModule",
    "StackedDigitsDataModule",
    "TaskRegressionDataModule",
    "TextDataModule",
    "Vocabulary",
]
