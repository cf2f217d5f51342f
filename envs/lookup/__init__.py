"""Lookup environment: a long inventory table in the prompt and a `lookup` tool (long shared prefix)."""

from envs.lookup.env import ExactCity, GroundedCity, LookupEnv, LookupTask
from envs.lookup.table import Row, Table, make_table

__all__ = ["ExactCity", "GroundedCity", "LookupEnv", "LookupTask", "Row", "Table", "make_table"]
