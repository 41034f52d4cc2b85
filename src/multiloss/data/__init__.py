"""LightningDataModules over data that ships offline (nothing downloads at run time), and the user's own files."""

from multiloss.data.arrays import ArrayDataModule
from multiloss.data.digits import DigitPairsDataModule, DigitsDataModule, StackedDigitsDataModule
from multiloss.data.npz import NpzDataModule
from multiloss.data.regression import TaskRegressionDataModule
from multiloss.data.text import TextDataModule, Vocabulary

__all__ = [
    "ArrayDataModule",
    "DigitPairsDataModule",
    "DigitsDataModule",
    "NpzDataModule",
    "StackedDigitsDataModule",
    "TaskRegressionDataModule",
    "TextDataModule",
    "Vocabulary",
]
