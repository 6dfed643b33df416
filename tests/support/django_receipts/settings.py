"""The contrib tests' settings with this app installed (a subprocess's DJANGO_SETTINGS_MODULE)."""

from tests.integration.contrib.django_settings import *  # noqa: F403
from tests.integration.contrib.django_settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "tests.support.django_receipts"]
ROOT_URLCONF = "tests.support.django_receipts.views"
