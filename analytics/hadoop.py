"""Hadoop FileSystem access through the JVM gateway.

Input and output may be any Hadoop path (``file:``, ``hdfs:``, ``s3a:``, ...), so listing the
log, publishing single-file CSVs and writing the HTML report go through Hadoop's FileSystem
API rather than Python file I/O, which only sees the driver's local disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pyspark.sql import SparkSession


@dataclass(frozen=True)
class HadoopFS:
    """A thin, typed wrapper over ``org.apache.hadoop.fs.FileSystem`` for one session."""

    spark: SparkSession

    @property
    def _jvm(self) -> Any:
        return self.spark.sparkContext._jvm

    def _path(self, path: str) -> Any:
        return self._jvm.org.apache.hadoop.fs.Path(path)

    def _fs(self, jpath: Any) -> Any:
        conf = self.spark.sparkContext._jsc.hadoopConfiguration()
        return jpath.getFileSystem(conf)

    def exists(self, path: str) -> bool:
        jpath = self._path(path)
        return bool(self._fs(jpath).exists(jpath))

    def is_file(self, path: str) -> bool:
        jpath = self._path(path)
        return bool(self._fs(jpath).getFileStatus(jpath).isFile())

    def list_files(self, directory: str) -> list[str]:
        """Fully qualified paths of the plain files directly inside ``directory``."""
        jpath = self._path(directory)
        return [
            str(status.getPath().toString())
            for status in self._fs(jpath).listStatus(jpath)
            if status.isFile()
        ]

    def list_tree(self, directory: str) -> list[str]:
        """Like ``list_files``, plus the files of sub-folders at any depth, except folders
        whose name starts with ``.`` or ``_`` (hidden, or Spark's ``_temporary``)."""
        jpath = self._path(directory)
        found: list[str] = []
        for status in self._fs(jpath).listStatus(jpath):
            path = str(status.getPath().toString())
            if status.isFile():
                found.append(path)
            elif status.isDirectory() and not self.name(path).startswith((".", "_")):
                found.extend(self.list_tree(path))
        return found

    def name(self, path: str) -> str:
        return str(self._path(path).getName())

    def child(self, directory: str, name: str) -> str:
        return str(self._jvm.org.apache.hadoop.fs.Path(directory, name).toString())

    def mkdirs(self, directory: str) -> None:
        jpath = self._path(directory)
        self._fs(jpath).mkdirs(jpath)

    def delete(self, path: str) -> None:
        jpath = self._path(path)
        self._fs(jpath).delete(jpath, True)

    def move(self, source: str, destination: str) -> None:
        """Rename ``source`` to ``destination``, replacing it (rename refuses to overwrite)."""
        src, dst = self._path(source), self._path(destination)
        fs = self._fs(dst)
        if fs.exists(dst):
            fs.delete(dst, True)
        if not fs.rename(src, dst):
            raise OSError(f"could not move {source} to {destination}")

    def write_bytes(self, path: str, data: bytes) -> None:
        jpath = self._path(path)
        stream = self._fs(jpath).create(jpath, True)
        try:
            stream.write(data)
        finally:
            stream.close()
