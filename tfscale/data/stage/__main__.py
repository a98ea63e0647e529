from tfscale.data.stage import stage

if __name__ == "__main__":
    stage.run()
