"""Tests of the PySpark analytics jobs (issue 5), on one shared local SparkSession."""
