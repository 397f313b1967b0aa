from django.db import models


class Point(models.Model):
    """The effect we count: one row per award. No unique job_id: the fence alone makes it one."""

    job_id = models.CharField(max_length=200)
    account = models.CharField(max_length=100)
    amount = models.IntegerField()
