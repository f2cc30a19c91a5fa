"""The one exception the input pipeline raises for bad data or settings, and the errors of a
failed download that it turns into one."""

import urllib.error

import requests
import tensorflow_datasets as tfds

from transformer.config import SettingError

# What TFDS's download manager raises when a file cannot be fetched.
DOWNLOAD_ERRORS = (tfds.download.DownloadError, requests.RequestException, urllib.error.URLError)


class DataError(SettingError):
  """Input that cannot be used; the message names the file (and line) or key, and the fix."""
