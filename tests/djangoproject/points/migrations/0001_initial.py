from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies = [("jobfence", "0001_jobfence_schema")]
    operations = [
        migrations.CreateModel(
            name="Point",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("job_id", models.CharField(max_length=200)),
                ("account", models.CharField(max_length=100)),
                ("amount", models.IntegerField()),
            ],
        )
    ]
