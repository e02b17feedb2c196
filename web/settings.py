"""Dashboard settings, from the environment (SPIKEWATCH_*), obtained through a cached getter."""

from __future__ import annotations

from functools import lru_cache

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings", "get_settings"]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPIKEWATCH_", extra="ignore")

    db_url: str | None = Field(
        None, description="Store URL; None = the observatory's default (runs/spikewatch.db)."
    )
    token: str | None = Field(None, description="Bearer token of the control endpoints.")
    read_token: str | None = Field(None, description="Bearer token for reading; None = open.")
    default_buckets: int = Field(2000, ge=10, le=20000, description="Buckets per series.")


@lru_cache
def get_settings() -> Settings:
    return Settings()
