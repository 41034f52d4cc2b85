"""LightningDataModules over data that ships offline (nothing downloads at run time)."""

from multiloss.data.arrays import ArrayDataModule
from multiloss.data.digits import DigitsDataModule
from multiloss.data.npz import NpzDataModule

__all__ = ["ArrayDataModule", "DigitsDataModule", "NpzDataModule"]
