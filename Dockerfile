# lockgate image for docker-compose.yml: edge, workers and `lockgate topics ensure`.
# GPU workers need the NVIDIA container toolkit on the host; torch's wheel bundles CUDA.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY . /app
RUN pip install . && useradd --create-home lockgate
USER lockgate
ENTRYPOINT ["lockgate"]
CMD ["--help"]
